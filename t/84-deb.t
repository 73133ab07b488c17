#!/usr/bin/perl

# The Debian package (make deb): it builds lintian-clean, installs on this
# machine (the module in nginx's module folder, its load file enabled in
# /etc/nginx/modules-enabled), passes nginx -t with Debian's stock
# /etc/nginx/nginx.conf plus a site that uses it, carries a real session
# (a swap and a restore, the real llama-server) with nginx started as the
# stock configuration starts it (no systemd, workers as www-data), and goes
# away cleanly.  It changes the machine: run as root; it removes the
# package and its site at the end, also on failure.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;

$> == 0 or plan skip_all => 'installs a package: needs root';

my $root = $LlamaTest::ROOT;
my $pkg = 'libnginx-mod-http-llama-session';
my $site = '/etc/nginx/sites-enabled/llama-session-test';

END {
    unlink $site;
    system("dpkg --purge $pkg >/dev/null 2>&1");
}

my $out = `make -C $root deb 2>&1`;
is($?, 0, 'make deb builds the package') or diag $out;
my ($deb) = glob("$root/build/deb/${pkg}_*_*.deb");
ok($deb && -s $deb, 'the .deb is there');
my $lintian = `grep -E '^(E|W): ' $root/build/deb/lintian.log`;
is($lintian, '', 'lintian: no error, no warning');

like(`dpkg-deb -f $deb Depends`, qr/nginx-abi-[\d.]+-\d+/,
     'it depends on the ABI of the nginx it was built for');

$out = `dpkg -i $deb 2>&1`;
is($?, 0, 'dpkg -i installs it') or diag $out;
ok(-e '/usr/lib/nginx/modules/ngx_http_llama_session_module.so',
   'the module is in nginx\'s module folder');
is(readlink('/etc/nginx/modules-enabled/50-mod-http-llama-session.conf'),
   '/usr/share/nginx/modules-available/mod-http-llama-session.conf',
   'and enabled');
like(`cat /usr/share/nginx/modules-available/mod-http-llama-session.conf`,
     qr{^load_module modules/ngx_http_llama_session_module\.so;}m,
     'its load file');
ok(-e "/usr/share/doc/$pkg/examples/nginx.conf", 'the examples');
ok(-e "/usr/share/doc/$pkg/directives.md.gz", 'and the docs');

# every doc and example the shipped README points to is in the package

my $readme = `zcat -f /usr/share/doc/$pkg/README.md* 2>/dev/null`;
my %named = map { $_ => 1 } $readme =~ m{`((?:docs|examples)/[\w./-]+)`}g;
ok(keys(%named) > 10, scalar(keys %named) . ' files named by the README');
for my $f (sort keys %named) {
    (my $base = $f) =~ s{/$}{};
    my $path = $base =~ m{^docs/(.*)} ? "/usr/share/doc/$pkg/$1"
                                      : "/usr/share/doc/$pkg/$base";
    ok(-e $path || -e "$path.gz", "the package has $f");
}
my $avail = '/etc/nginx/sites-available/llama-session.conf';
ok(-f $avail, 'the Debian site is installed in sites-available');
ok(!-e '/etc/nginx/sites-enabled/llama-session.conf', 'and not enabled');

# a site that uses it, beside Debian's stock configuration

my $t = LlamaTest->new(workers => 2);
my $dir = $t->dir;
my $llama = $t->llama(np => 1, ctx => 8192);
my $port = LlamaTest::port();
my $slots = $t->{slots};

open my $fh, '>', $site or die;
print $fh <<"EOF2";
llama_session_zone zone=pkgtest:1m store=$slots;

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

$out = `/usr/sbin/nginx -t 2>&1`;
is($?, 0, 'nginx -t with the stock nginx.conf and the site') or diag $out;

# started as the stock configuration starts it, without systemd; only its
# pid file and error log elsewhere, and only this site (port 80 may be
# another's)

my $stock = do { local $/; open my $s, '<', '/etc/nginx/nginx.conf' or die; <$s> };
$stock =~ s{^pid .*$}{pid $dir/pkg-nginx.pid;}m;
$stock =~ s{^error_log .*$}{error_log $dir/pkg-error.log info;}m;
$stock =~ s{include /etc/nginx/sites-enabled/\*;}{include $site;};
$stock =~ s{access_log .*?;}{access_log $dir/pkg-access.log;}g;
open $fh, '>', "$dir/pkg-nginx.conf" or die;
print $fh $stock;
close $fh;

$t->spawn('pkg-nginx', "$dir/pkg-nginx.out", '/usr/sbin/nginx',
          '-c', "$dir/pkg-nginx.conf", '-g', 'daemon off;');
$t->wait_port($port, 20, 'pkg-nginx');

my %conv;
sub turn {
    my ($sid) = @_;
    $conv{$sid} //= [ { role => 'user', content => join ' ', map {
                          "Session $sid keeps note $_." } 1 .. 40 } ];
    my $r = $t->post('/v1/chat/completions',
                     { messages => $conv{$sid}, max_tokens => 2,
                       temperature => 0 },
                     headers => { 'X-Session-Id' => $sid }, port => $port);
    push @{ $conv{$sid} }, { role => 'assistant', content => 'ok' },
                           { role => 'user', content => "More, $sid." };
    return $r;
}

my $a1 = turn('a');
is($a1->{status}, 200, 'a session through the packaged module');
turn('b');
my $a2 = turn('a');
is($a2->{headers}{'x-s-action'}, 'restore', 'it returns restored');
ok($a2->{json}{timings}{cache_n} >= $a1->{json}{usage}{prompt_tokens} - 1,
   "with its cache: $a2->{json}{timings}{cache_n} tokens");
my @workers = `ps -o user= --ppid \$(cat $dir/pkg-nginx.pid)`;
chomp @workers;
ok(@workers && !grep({ $_ ne 'www-data' } @workers),
   'the workers run as www-data');

# an upgrade under a running nginx says that it needs a restart

$out = `dpkg -i $deb 2>&1`;
is($?, 0, 'dpkg -i again (an upgrade)') or diag $out;
like($out, qr/restart nginx to load the new module/,
     'it says that a running nginx needs a restart');

$t->stop_proc('pkg-nginx');

# the shipped site, as an operator enables it: in Debian's stock /etc/nginx
# (only its ports, backend, store and certificate are this test's)

# llama-server as the site's header runs it: its RAM cache is the hot tier
# (ram=), the store's files the cold one
my $llama2 = $t->llama(name => 'shipped', np => 1, ctx => 8192,
                       cache_ram => 1024, sps => 0.1);
my $port2 = LlamaTest::port();
my $shipped = do { local $/; open my $s, '<', $avail or die; <$s> };
$shipped =~ s{listen 443 ssl;}{listen 127.0.0.1:$port2 ssl;};
$shipped =~ s{\s*listen \[::\]:443 ssl;}{};
$shipped =~ s{127\.0\.0\.1:8080}{127.0.0.1:$llama2}g;
$shipped =~ s{/var/lib/llama-session}{$slots}g;
$shipped =~ s{/var/log/nginx/}{$dir/}g;
$shipped =~ s{/etc/ssl/\S+/ssl-cert-snakeoil\.(pem|key)}{$dir/site.$1}g;
system("openssl req -x509 -newkey rsa:2048 -nodes -subj /CN=localhost "
       . "-keyout $dir/site.key -out $dir/site.pem -days 2 >/dev/null 2>&1");
open $fh, '>', $site or die;
print $fh $shipped;
close $fh;

$out = `/usr/sbin/nginx -t 2>&1`;
is($?, 0, 'nginx -t with the stock /etc/nginx and the shipped site')
    or diag $out;

$t->spawn('pkg-nginx2', "$dir/pkg-nginx2.out", '/usr/sbin/nginx',
          '-c', "$dir/pkg-nginx.conf", '-g', 'daemon off;');
$t->wait_port($port2, 20, 'pkg-nginx2');

sub tls_turn {
    my ($sid, $text) = @_;
    my $body = $LlamaTest::JSON->encode({
        messages => [ { role => 'user', content => join ' ', map {
                          "Session $sid keeps note $_ of the site." } 1 .. 40 } ],
        max_tokens => 2, temperature => 0 });
    open my $b, '>', "$dir/tls-body.json" or die;
    print $b $body;
    close $b;
    my $reply = `curl -sk -D $dir/tls-headers -H 'Content-Type: application/json' -H 'X-Session-Id: $sid' --data-binary \@$dir/tls-body.json https://127.0.0.1:$port2/v1/chat/completions`;
    my $headers = $t->read_file("$dir/tls-headers");
    my ($status) = $headers =~ m{^HTTP/\S+ (\d+)};
    return ($status // 0, eval { $LlamaTest::JSON->decode($reply) } // {});
}

my ($st1, $j1) = tls_turn('site-a');
is($st1, 200, 'a session through the shipped site, over TLS');
tls_turn('site-b');
my ($st2, $j2) = tls_turn('site-a');
is($st2, 200, 'its second turn');
ok(($j2->{timings}{cache_n} // 0) >= ($j1->{usage}{prompt_tokens} // 1e9) - 1,
   'comes back with its cache: ' . ($j2->{timings}{cache_n} // 'none'));
my $alog = $t->read_file("$dir/llama-session.log");
like($alog, qr/session=site-a action=ram slot=0 cached=\d+/,
     'the access log shows the action (out of llama-server\'s RAM, no '
     . 'slot action) and the cached tokens');
my $elog = $t->read_file("$dir/llama-session.error.log");
unlike($elog, qr/buffered to a temporary file/,
       'no prompt was written to a temporary file');
my ($code) = `curl -sk -o /dev/null -w '%{http_code}' https://127.0.0.1:$port2/slots`;
is($code, 403, 'a client\'s GET /slots is refused');
($code) = `curl -sk -o /dev/null -w '%{http_code}' 'https://127.0.0.1:$port2/props?model=x'`;
is($code, 403, 'and GET /props?model=');

$t->stop_proc('pkg-nginx2');

# removed while a site still uses it: it says which

$out = `dpkg -r $pkg 2>&1`;
is($?, 0, 'dpkg -r removes it') or diag $out;
like($out, qr/still use the module's directives.*\Q$site\E/s,
     'and names the site that still uses its directives');
unlink $site;
ok(!-e '/usr/lib/nginx/modules/ngx_http_llama_session_module.so',
   'the module is gone');
ok(!-e '/etc/nginx/modules-enabled/50-mod-http-llama-session.conf',
   'and its load file is no longer enabled');
$out = `/usr/sbin/nginx -t 2>&1`;
is($?, 0, 'the stock configuration is fine without it') or diag $out;
$out = `dpkg --purge $pkg 2>&1`;
is($?, 0, 'dpkg --purge') or diag $out;
is(`dpkg-query -W -f='\${Status}' $pkg 2>/dev/null`, '', 'nothing of it is left');

$t->stop;
done_testing;
