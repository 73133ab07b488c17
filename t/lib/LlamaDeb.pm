package LlamaDeb;

# The Debian package's first hour, as an operator lives it (t/84-deb.t on
# this machine, t/107-deb-trixie.t in a Debian 13 root): make deb builds it
# lintian-clean; dpkg -i installs it (the module in nginx's module folder,
# its load file enabled, the docs and examples the README names, the site
# in sites-available); nginx -t passes with Debian's stock nginx.conf plus
# a site that uses it; nginx started as the stock configuration starts it
# (no systemd, workers as www-data) carries a real session (a swap and a
# restore, the real llama-server); an upgrade under a running nginx says
# it needs a restart; the shipped site, enabled as an operator does, serves
# over TLS from llama-server's RAM tier; removal names the site that still
# uses the module, and nothing is left after the purge.
#
# first_hour(suite => 'trixie'): all of it in the release's root
# (rig/debian-root.sh): the package built there (make deb DEBIAN=suite),
# dpkg and nginx run in it by chroot; llama-server and the clients stay on
# this machine, on loopback, which the root shares.  It changes the
# machine (or the root): root only; the package and its site go at the
# end, also on failure.

use strict;
use warnings;

use File::Path qw(make_path remove_tree);
use File::Temp qw(tempdir);
use LlamaTest;
use Test::More;

sub first_hour {
    my (%o) = @_;
    my $suite = $o{suite};
    my $top = $LlamaTest::ROOT;
    my $pkg = 'libnginx-mod-http-llama-session';

    # the root ('' this machine) and the commands run in it
    my $R = '';
    my @in = ();
    my $debdir = "$top/build/deb";
    my $make = "make -C $top deb";

    if ($suite) {
        $R = `$top/rig/debian-root.sh $suite 2>&1`;
        chomp $R;
        $R =~ s/.*\n//s;
        ok(-x "$R/usr/sbin/nginx", "the Debian $suite root has its nginx")
            or BAIL_OUT("no Debian $suite root: $R");
        @in = ('chroot', $R);
        $debdir = "$top/build/deb-$suite";
        $make .= " DEBIAN=$suite";
    }

    my $run = sub {
        my $cmd = join ' ', @in, @_;
        $cmd .= ' 2>&1' unless $cmd =~ /2>/;
        my $out = `$cmd`;
        return wantarray ? ($?, $out) : $out;
    };

    my $site = '/etc/nginx/sites-enabled/llama-session-test';
    my @mounts;

    my $t = LlamaTest->new(workers => 2);
    my $dir = $t->dir;

    # where nginx in the root sees the test's files: $in there, $R$in here
    my $in = $dir;
    if ($R) {
        make_path("$R/tmp");
        $in = tempdir('llama-session-deb-XXXXXX', DIR => "$R/tmp");
        chmod 0755, $in;
        $in =~ s/^\Q$R\E//;

        # its pidof sees nginx (the upgrade's message); the module reads
        # the model's GGUF file at the path llama-server gives
        for my $m ([ 'proc', '/proc', '-t proc proc' ],
                   [ 'model', LlamaTest::llama_model() =~ s{/[^/]+$}{}r ]) {
            my ($what, $path, $how) = @$m;
            make_path("$R$path");
            next if system("mountpoint -q $R$path") == 0;
            system('mount ' . ($how // "--bind -o ro $path") . " $R$path") == 0
                or BAIL_OUT("cannot mount $what in the root");
            push @mounts, "$R$path";
        }
    }
    my $pd = "$R$in";

    my $cleanup = sub {
        unlink "$R$site";
        system(join(' ', @in, "dpkg --purge $pkg >/dev/null 2>&1"));
        system("umount -l $_") for reverse @mounts;
        @mounts = ();
        remove_tree($pd) if $R && $pd ne $R;
    };
    my $ok = eval {
        run($t, $R, $in, $pd, $pkg, $site, $debdir, $make, $run);
        1;
    };
    my $err = $@;
    $t->stop;
    $cleanup->();
    die $err unless $ok;
}

sub run {
    my ($t, $R, $in, $pd, $pkg, $site, $debdir, $make, $run) = @_;
    my ($rc, $out);

    $out = `$make 2>&1`;
    is($?, 0, 'make deb builds the package') or diag $out;
    my ($deb) = glob("$debdir/${pkg}_*_*.deb");
    ok($deb && -s $deb, 'the .deb is there');
    my $lintian = `grep -E '^(E|W): ' $debdir/lintian.log`;
    is($lintian, '', 'lintian: no error, no warning');

    my ($abi) = `dpkg-deb -f $deb Depends` =~ /(nginx-abi-[\d.]+-\d+)/;
    ok($abi, 'it depends on the ABI of the nginx it was built for: '
              . ($abi // 'none'));
    like($run->("dpkg-query -W -f='\${Provides}' nginx"), qr/\Q$abi\E/,
         'the ABI of the nginx installed there') if $abi;

    # dpkg -i of a file in the root
    my $install = sub {
        system("cp $deb $pd/pkg.deb") == 0 or die "cp: $!";
        return $run->("dpkg -i $in/pkg.deb");
    };

    ($rc, $out) = $install->();
    is($rc, 0, 'dpkg -i installs it') or diag $out;
    ok(-e "$R/usr/lib/nginx/modules/ngx_http_llama_session_module.so",
       'the module is in nginx\'s module folder');
    is(readlink("$R/etc/nginx/modules-enabled/50-mod-http-llama-session.conf"),
       '/usr/share/nginx/modules-available/mod-http-llama-session.conf',
       'and enabled');
    like(`cat $R/usr/share/nginx/modules-available/mod-http-llama-session.conf`,
         qr{^load_module modules/ngx_http_llama_session_module\.so;}m,
         'its load file');
    ok(-e "$R/usr/share/doc/$pkg/examples/nginx.conf", 'the examples');
    ok(-e "$R/usr/share/doc/$pkg/directives.md.gz", 'and the docs');

    # every doc and example the shipped README points to is in the package

    my $readme = `zcat -f $R/usr/share/doc/$pkg/README.md* 2>/dev/null`;
    my %named = map { $_ => 1 } $readme =~ m{`((?:docs|examples)/[\w./-]+)`}g;
    ok(keys(%named) > 10, scalar(keys %named) . ' files named by the README');
    for my $f (sort keys %named) {
        (my $base = $f) =~ s{/$}{};
        my $path = $base =~ m{^docs/(.*)} ? "$R/usr/share/doc/$pkg/$1"
                                          : "$R/usr/share/doc/$pkg/$base";
        ok(-e $path || -e "$path.gz", "the package has $f");
    }
    my $avail = '/etc/nginx/sites-available/llama-session.conf';
    ok(-f "$R$avail", 'the Debian site is installed in sites-available');
    ok(!-e "$R/etc/nginx/sites-enabled/llama-session.conf", 'and not enabled');

    # a site that uses it, beside Debian's stock configuration

    my $slots = LlamaTest::slots_dir("$pd/slots");
    my $llama = $t->llama(np => 1, ctx => 8192, slots => $slots);
    my $port = LlamaTest::port();

    open my $fh, '>', "$R$site" or die;
    print $fh <<"EOF2";
llama_session_zone zone=pkgtest:1m store=$in/slots;

server {
    listen 127.0.0.1:$port;

    location / {
        llama_session pkgtest;
        proxy_pass http://127.0.0.1:$llama;
        add_header X-S-Action \$llama_session_action always;
    }

    location /_llama_slots/ {
        internal;
        proxy_pass http://127.0.0.1:$llama/;
    }
}
EOF2
    close $fh;

    ($rc, $out) = $run->('/usr/sbin/nginx -t');
    is($rc, 0, 'nginx -t with the stock nginx.conf and the site') or diag $out;

    # started as the stock configuration starts it, without systemd; only
    # its pid file and error log elsewhere, and only this site (port 80
    # may be another's)

    my $stock = $t->read_file("$R/etc/nginx/nginx.conf");
    $stock =~ s{^pid .*$}{pid $in/pkg-nginx.pid;}m;
    $stock =~ s{^error_log .*$}{error_log $in/pkg-error.log info;}m;
    $stock =~ s{include /etc/nginx/sites-enabled/\*;}{include $site;};
    $stock =~ s{access_log .*?;}{access_log $in/pkg-access.log;}g;
    open $fh, '>', "$pd/pkg-nginx.conf" or die;
    print $fh $stock;
    close $fh;

    my @nginx = ((length $R ? ('chroot', $R) : ()), '/usr/sbin/nginx',
                 '-c', "$in/pkg-nginx.conf", '-g', 'daemon off;');
    $t->spawn('pkg-nginx', "$pd/pkg-nginx.out", @nginx);
    $t->wait_port($port, 20, 'pkg-nginx');

    my %conv;
    my $turn = sub {
        my ($sid) = @_;
        $conv{$sid} //= [ { role => 'user', content => join ' ', map {
                              "Session $sid keeps note $_." } 1 .. 40 } ];
        my $r = $t->post('/v1/chat/completions',
                         { messages => $conv{$sid}, max_tokens => 2,
                           temperature => 0 },
                         headers => { 'X-Session-Id' => $sid },
                         port => $port);
        push @{ $conv{$sid} }, { role => 'assistant', content => 'ok' },
                               { role => 'user', content => "More, $sid." };
        return $r;
    };

    my $a1 = $turn->('a');
    is($a1->{status}, 200, 'a session through the packaged module');
    $turn->('b');
    my $a2 = $turn->('a');
    is($a2->{headers}{'x-s-action'}, 'restore', 'it returns restored');
    ok(($a2->{json}{timings}{cache_n} // 0)
           >= ($a1->{json}{usage}{prompt_tokens} // 1e9) - 1,
       'with its cache: ' . ($a2->{json}{timings}{cache_n} // 'none')
       . ' tokens');
    my @saved = glob("$slots/*.bin");
    ok(@saved >= 1, 'the sessions\' files in the store: ' . scalar @saved);
    my @workers = `ps -o user= --ppid \$(cat $pd/pkg-nginx.pid)`;
    chomp @workers;
    ok(@workers && !grep({ $_ ne 'www-data' } @workers),
       'the workers run as www-data');

    # an upgrade under a running nginx says that it needs a restart

    ($rc, $out) = $install->();
    is($rc, 0, 'dpkg -i again (an upgrade)') or diag $out;
    like($out, qr/restart nginx to load the new module/,
         'it says that a running nginx needs a restart');

    $t->stop_proc('pkg-nginx');

    # the shipped site, as an operator enables it: in Debian's stock
    # /etc/nginx (only its ports, backend, store and certificate are the
    # test's); llama-server as the site's header runs it: its RAM cache is
    # the hot tier (ram=), the store's files the cold one

    my $llama2 = $t->llama(name => 'shipped', np => 1, ctx => 8192,
                           cache_ram => 1024, sps => 0.1, slots => $slots);
    my $port2 = LlamaTest::port();
    my $shipped = $t->read_file("$R$avail");
    $shipped =~ s{listen 443 ssl;}{listen 127.0.0.1:$port2 ssl;};
    $shipped =~ s{\s*listen \[::\]:443 ssl;}{};
    $shipped =~ s{127\.0\.0\.1:8080}{127.0.0.1:$llama2}g;
    $shipped =~ s{/var/lib/llama-session}{$in/slots}g;
    $shipped =~ s{/var/log/nginx/}{$in/}g;
    $shipped =~ s{/etc/ssl/\S+/ssl-cert-snakeoil\.(pem|key)}{$in/site.$1}g;
    system("openssl req -x509 -newkey rsa:2048 -nodes -subj /CN=localhost "
           . "-keyout $pd/site.key -out $pd/site.pem -days 2 >/dev/null 2>&1");
    open $fh, '>', "$R$site" or die;
    print $fh $shipped;
    close $fh;

    ($rc, $out) = $run->('/usr/sbin/nginx -t');
    is($rc, 0, 'nginx -t with the stock /etc/nginx and the shipped site')
        or diag $out;

    $t->spawn('pkg-nginx2', "$pd/pkg-nginx2.out", @nginx);
    $t->wait_port($port2, 20, 'pkg-nginx2');

    my $tls_turn = sub {
        my ($sid) = @_;
        my $body = $LlamaTest::JSON->encode({
            messages => [ { role => 'user', content => join ' ', map {
                      "Session $sid keeps note $_ of the site." } 1 .. 40 } ],
            max_tokens => 2, temperature => 0 });
        open my $b, '>', "$pd/tls-body.json" or die;
        print $b $body;
        close $b;
        my $reply = `curl -sk -D $pd/tls-headers -H 'Content-Type: application/json' -H 'X-Session-Id: $sid' --data-binary \@$pd/tls-body.json https://127.0.0.1:$port2/v1/chat/completions`;
        my $headers = $t->read_file("$pd/tls-headers");
        my ($status) = $headers =~ m{^HTTP/\S+ (\d+)};
        return ($status // 0, eval { $LlamaTest::JSON->decode($reply) } // {});
    };

    my ($st1, $j1) = $tls_turn->('site-a');
    is($st1, 200, 'a session through the shipped site, over TLS');
    $tls_turn->('site-b');
    my ($st2, $j2) = $tls_turn->('site-a');
    is($st2, 200, 'its second turn');
    ok(($j2->{timings}{cache_n} // 0) >= ($j1->{usage}{prompt_tokens} // 1e9) - 1,
       'comes back with its cache: ' . ($j2->{timings}{cache_n} // 'none'));
    # the log phase may end a moment after curl has the reply
    my $alog = '';
    $t->wait_for(sub {
        $alog = $t->read_file("$pd/llama-session.log");
        $alog =~ /session=site-a action=\w+ .*\n.*session=site-a /s }, 5);
    like($alog, qr/session=site-a action=ram slot=0 cached=\d+/,
         'the access log shows the action (out of llama-server\'s RAM, no '
         . 'slot action) and the cached tokens');
    my $elog = $t->read_file("$pd/llama-session.error.log");
    unlike($elog, qr/buffered to a temporary file/,
           'no prompt was written to a temporary file');
    my ($code) = `curl -sk -o /dev/null -w '%{http_code}' https://127.0.0.1:$port2/slots`;
    is($code, 403, 'a client\'s GET /slots is refused');
    ($code) = `curl -sk -o /dev/null -w '%{http_code}' 'https://127.0.0.1:$port2/props?model=x'`;
    is($code, 403, 'and GET /props?model=');

    $t->stop_proc('pkg-nginx2');

    # removed while a site still uses it: it says which

    ($rc, $out) = $run->("dpkg -r $pkg");
    is($rc, 0, 'dpkg -r removes it') or diag $out;
    like($out, qr/still use the module's directives.*\Q$site\E/s,
         'and names the site that still uses its directives');
    unlink "$R$site";
    ok(!-e "$R/usr/lib/nginx/modules/ngx_http_llama_session_module.so",
       'the module is gone');
    ok(!-e "$R/etc/nginx/modules-enabled/50-mod-http-llama-session.conf",
       'and its load file is no longer enabled');
    ($rc, $out) = $run->('/usr/sbin/nginx -t');
    is($rc, 0, 'the stock configuration is fine without it') or diag $out;
    ($rc, $out) = $run->("dpkg --purge $pkg");
    is($rc, 0, 'dpkg --purge') or diag $out;
    is(scalar $run->("dpkg-query -W -f='\${Status}' $pkg 2>/dev/null"), '',
       'nothing of it is left');
}

1;
