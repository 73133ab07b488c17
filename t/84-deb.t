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

$t->stop_proc('pkg-nginx');

# and it goes away cleanly

unlink $site;
$out = `dpkg -r $pkg 2>&1`;
is($?, 0, 'dpkg -r removes it') or diag $out;
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
